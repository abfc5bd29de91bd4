"""One run, for both engines: the client side (client.py, workers.py), the server side (server.py), the
in-process engine (engine.py), the run's lifecycle and files (lifecycle.py, client_store.py,
run_dir.py, data_cache.py), its models written out (export.py, adapter_folder.py, model_card.py)
and the process's memory allocator (allocator.py). The Flower engine (pflalign.flower) uses the
same client side, server side and lifecycle.

No imports here: `pflalign.run.allocator` must load without torch (allocator.py says why).
"""
