"""The engine family: everything draftgen knows of each inference engine, in one folder.

    base.py       the contract (`Engine`): launch flags by installed release, reading a
                  running server back, load endpoints, token-id fields, prompt counting and
                  context, the probe's scorer, the tune's levers
    info.py       ServerInfo: what a running server reports, whichever engine
    load.py       ServerLoad and the Prometheus reading every engine shares
    scoring.py    the probe's scoring contract and its HTTP session
    install.py    which release a profile's interpreter has, and the flags it defines
    common.py     helpers the engines share
    spec.py       LaunchSpec: what an engine reads of a server profile
    dtypes.py     KV cache dtype spellings, and which ones lose information
    registry.py   `engine:` name → Engine; readers that ask each engine in turn
    sglang/ vllm/ one folder per engine

A new engine is a folder here and a line in registry.py. Outside this folder nothing names
an engine (tests/unit/test_layout.py); code elsewhere imports base, info, load, scoring,
install, common, spec, dtypes and registry only (import-linter, pyproject.toml); the
family imports nothing of servers/ or gateways/.
"""
