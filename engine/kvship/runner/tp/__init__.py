"""The tensor-parallel runtime: starting ranks, the step protocol between them, all-reduce."""
