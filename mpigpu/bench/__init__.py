"""The tools that measure mpigpu: ``python -m mpigpu.bench`` (main), the sweep, the user-call and
collective rows, the anchors it is compared with, reports, the training benchmark and the soak test.
Importing this package loads none of them."""
