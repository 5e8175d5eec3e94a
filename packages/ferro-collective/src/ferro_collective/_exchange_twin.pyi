"""The twin's all-to-alls: C functions only (``_onecall`` calls them)."""
