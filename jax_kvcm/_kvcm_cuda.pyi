from typing import Any

def registrations() -> dict[str, Any]:
    """FFI handler capsules by target name, for platform "CUDA"."""
