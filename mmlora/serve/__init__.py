"""Scale-out on Ray Serve (the optional extra ``mmlora[ray]``): replicas of one mmlora engine each,
with requests routed to a replica that already holds their adapter (Ray Serve model multiplexing).

``python -m mmlora.serve --model M --num-replicas N --lora-root DIR [engine and server flags]``, or
``serve run mmlora.serve.app:app_builder model=M num_replicas=N lora_root=DIR``.
"""
