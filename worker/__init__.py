"""The worker service: the model, its paged KV cache and the sampler, run one step at a time.

``model_runner`` turns each scheduler step (``kvmesh.services.contracts.step``) into sampled
tokens: ``input_batch`` keeps the requests' state on the worker between steps,
``step_inputs`` builds the model's inputs, ``models`` holds the architectures and
``sampler`` picks the tokens. ``server`` puts it behind gRPC.
"""
