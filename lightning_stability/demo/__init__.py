"""The demo: one fragile run with a plain Trainer and with a preset (``lightning-stability demo``).

* ``model.py``: its data (a frozen copy of this package's source text, ``corpus.txt.gz``) and model, a Post-LN
  character-level GPT.
* ``run.py``: the two runs, one judge for both (diverged / stalled / trained), the comparison chart.
"""
