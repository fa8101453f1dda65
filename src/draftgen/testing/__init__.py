"""Tools for testing draftgen against real engines: `faultproxy` injects HTTP faults
(`faults` decides which).

Import from the submodule (`from draftgen.testing.faultproxy import FaultProxy`). Nothing
is re-exported here on purpose: `python -m draftgen.testing.faultproxy` would otherwise
find the module already imported by its package and warn (runpy's RuntimeWarning).
"""
