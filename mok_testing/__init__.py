"""Fixtures for tests, demos and benchmarks at real shapes (torch; not part of the layer).

``synthetic``: deterministic layers and inputs any rank can rebuild without holding every
expert; ``sampled``: the float64 reference of the layer for sampled tokens (on the GPU when
there is one), for shapes where ``mok_core.reference`` over all tokens would take hours;
``host_waits``: what makes the host wait for the device during a step (GPU).
"""
