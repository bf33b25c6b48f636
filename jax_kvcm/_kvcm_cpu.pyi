from typing import Any

def registrations() -> dict[str, Any]:
    """FFI handler capsules by target name (kvcm_write_kv, kvcm_paged_attention, ...)."""
