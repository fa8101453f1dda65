"""vLLM, all of it: engine.py (launch, read back, the contract), info.py (cache_config_info,
/version, /v1/models), load.py (/metrics names), scoring.py (the probe), levers.py (the tune)."""
