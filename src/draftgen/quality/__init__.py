"""Data quality: checks on every generated turn, flagging what a drafter should not learn
from (the A/B probe of a server configuration is `draftgen.probe`; the quality policy for
launching servers is `servers/policy.py`)."""
