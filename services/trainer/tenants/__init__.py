"""One online trainer for many tenants: a lane per tenant on one shared policy (`lanes`), the
fair share of training turns between them (`fairshare`), and following the tenant registry's
creations, resets, holds and deletions (`follow`).

Stands on the online recipe (`services.trainer.recipes.online`), whose loop each lane runs;
the learner names nothing here (tests/hotloop/test_layering.py).
"""
