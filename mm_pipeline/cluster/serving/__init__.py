"""``mmserve serve --ray``: the OpenAI app on Ray Serve (docs/serving_on_ray.md).

    serve_app        the deployments and how they are laid out (ServeClusterConfig)
    llm_replica      one LLM replica: an OmniEngine behind a DeploymentHandle
    remote_engine    OmniEngine's API over that handle, for the ingress's FastAPI app
    encoder_replica  the encoder tier: encodes media into the shared encoder cache
    route_key        a request as a chain of block hashes (tokens + media content keys)
    router_state     the radix tree of dispatched prefixes (memory or Redis)
    write_behind     the Redis index's writer thread (ordered, bounded, off the event loop)
    affinity_policy  the LLM router's score and ranking
    prefix_router    that policy behind Ray Serve's RequestRouter (+ a round-robin baseline)
    consistent_hash  consistent hashing with bounded loads
    encoder_router   the ring behind Ray Serve's RequestRouter, for the encoder deployment
"""
