"""Pure policy both sides share: how a batch is split and balanced, where rounds end, what the
plan predicts. Plain Python on integers and floats: no torch, no Horovod, no SSH, so the
launcher imports it as the ranks do and `invoke plan`'s arithmetic is the ranks' own
(tests/test_layout.py holds it to that)."""
