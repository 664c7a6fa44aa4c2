"""sparkfleet: converge DGX Spark fleets to a declared vLLM serving state."""
