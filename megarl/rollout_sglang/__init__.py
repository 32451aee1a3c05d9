"""SGLang rollout engines: server processes (server.py, the CPU venv's Python: cpu_venv.py), the
HTTP client (client.py) and the engine built on it (engine.py, its tensor payloads:
tensor_payload.py), and the controller side: where servers run (hosts.py) and how the trainer
starts them and generates over them (controller.py). Weight transports are megarl/weight_sync/;
releasing, resuming and restarting engines is megarl/memory/ (sglang_memory.py).

Importing this package does not import SGLang (it is needed only inside the server
processes, and by the colocated tensor path for its bucket class); see docs/sglang.md.
"""
