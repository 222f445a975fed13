"""The ``rolloutpool`` command: embedded pool bring-up, the demo, and operator commands.

``pool`` (the core), ``router`` (data plane) and ``updater`` (control plane) are the libraries;
this package wires them together for a single machine.
"""
