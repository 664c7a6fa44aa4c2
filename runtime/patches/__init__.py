"""The runtime patches of the installed vLLM: one program per patch (see _patchlib)."""
