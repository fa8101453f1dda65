"""What unit, conformance and integration tests share: a scripted HTTP server, the SGLang
stand-in, and reading token masks."""
