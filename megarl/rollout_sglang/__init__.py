"""SGLang rollout engines: server processes (server.py), the HTTP client (client.py) and the
engine built on it (engine.py), weight transports (transports.py, tensor_payload.py,
update_group.py), and the controller side: where servers run (hosts.py) and how the trainer
starts, drives and restarts them (controller.py).

Importing this package does not import SGLang (it is needed only inside the server
processes, and by the colocated tensor path for its bucket class); see docs/sglang.md.
"""
