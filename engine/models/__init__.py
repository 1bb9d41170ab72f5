"""Model implementations, looked up by HF architecture name in `registry`."""
