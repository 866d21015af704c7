"""kvship inference engine (import name for the engine/ folder)."""
__version__ = "0.1.0"
