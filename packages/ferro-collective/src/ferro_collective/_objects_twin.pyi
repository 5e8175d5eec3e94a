"""The object collectives' twin: C functions only (``_onecall`` calls them)."""
