"""When the trainer computes: a batch job's step budget (`budget`: when it stops taking steps)
and how a trainer yields the host to the users the same engine serves (`usersfirst`).

Used by the recipes and the tenants' lanes; names neither (tests/hotloop/test_layering.py).
"""
