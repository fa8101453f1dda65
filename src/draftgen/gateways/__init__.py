"""The gateway family: everything draftgen knows of a router in front of many workers.

    base.py       the contract (`Gateway`): worker list, routing key and served-worker
                  headers, relayed metrics, launch argv; `Worker`, `GatewayError`
    registry.py   the gateways by name; which worker an answer's headers name
    profile.py    a gateway profile: worker server profiles and the gateway in front
    launch.py     launch, restart and stop a gateway profile's workers and gateway as one
    process.py    `LaunchedGateway`: a gateway process draftgen starts and stops
    load.py       the load of workers reached only through their gateway
    relayed.py    the settings of such a worker, as its gateway relays them
    smg/          the SGLang Model Gateway: one folder per gateway

A new gateway is a folder here and a line in registry.py. Outside this folder nothing names
one (tests/unit/test_layout.py); the run (running/gateways.py) and the client call the
registry, and nothing here imports a run (import-linter, pyproject.toml).
"""
