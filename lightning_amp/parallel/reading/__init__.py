"""Reading a model: which of its layers form tensor-parallel units, found from their types and names and from what
their forwards compute (torch.fx on meta shapes), with the heads, layouts and per-rank attribute values a split needs.

Reading changes nothing and knows nothing of conversion: what it finds becomes a plan value
(:class:`~lightning_amp.parallel.plan.TensorParallelPlan`), which :mod:`~lightning_amp.parallel.convert` applies.
"""
