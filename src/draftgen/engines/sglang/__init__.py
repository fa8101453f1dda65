"""SGLang, all of it: engine.py (launch, read back, the contract), info.py (/server_info),
load.py (/v1/loads, /metrics names), scoring.py (the probe), levers.py (the tune)."""
