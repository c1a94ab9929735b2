"""Replicas of the server on Ray Serve: `python -m albatross_serve --replicas N` with main.py's flags.

Each replica is our FastAPI app (runner.app.create_app) as a Serve ingress, loading its own model
on its own GPU group; Serve's HTTP proxy streams its responses unchanged; replicas share the state
tier through `--state-store redis://...`; a request carrying a session id reaches the replica that
holds the session's state in memory (consistent hashing, session_affinity.py), another one when that
replica is gone. See docs/deployment.md.
"""
