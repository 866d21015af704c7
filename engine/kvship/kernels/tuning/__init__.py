"""Launch settings of the Triton kernels, one module per kernel family. Each table names the
bench command that produced it; the figures behind it are in docs/performance.md. The kernel
modules import their tables from here, and benchmarks may override entries in place."""
