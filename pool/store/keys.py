"""Key names of one pool namespace (the map is in :mod:`pool.store`)."""

from __future__ import annotations


class Keys:
    """Key names for one namespace (see the module docstring)."""

    def __init__(self, namespace: str) -> None:
        self.p = "{" + namespace + "}"

    replicas = property(lambda self: f"{self.p}:replicas")
    leases = property(lambda self: f"{self.p}:leases")
    latest = property(lambda self: f"{self.p}:latest")
    generations = property(lambda self: f"{self.p}:generations")
    labels = property(lambda self: f"{self.p}:labels")
    journal = property(lambda self: f"{self.p}:journal")
    gen_admissions = property(lambda self: f"{self.p}:gen_admissions")
    gen_outcomes = property(lambda self: f"{self.p}:gen_outcomes")
    updates = property(lambda self: f"{self.p}:updates")
    updates_order = property(lambda self: f"{self.p}:updates:order")
    lease = property(lambda self: f"{self.p}:updater:lease")
    fence = property(lambda self: f"{self.p}:updater:fence")
    epochs = property(lambda self: f"{self.p}:epochs")
    routers = property(lambda self: f"{self.p}:routers")
    router_epochs = property(lambda self: f"{self.p}:routers:epochs")
    barrier = property(lambda self: f"{self.p}:barrier")
    version = property(lambda self: f"{self.p}:version")
    changes = property(lambda self: f"{self.p}:changes")

    def replica(self, rid: str) -> str:
        return f"{self.p}:replica:{rid}"

    def active(self, rid: str) -> str:
        return f"{self.p}:active:{rid}"

    def granted(self, rid: str) -> str:
        return f"{self.p}:granted:{rid}"

    def grant_generations(self, rid: str) -> str:
        return f"{self.p}:granted:{rid}:gen"

    def binding(self, rollout_id: str) -> str:
        return f"{self.p}:binding:{rollout_id}"

    def client_sessions(self, client: str) -> str:
        return f"{self.p}:client:{client}:sessions"
