"""What comes before a loss spike, measured cheaply, and the pure math of acting on it early.

Pure parts (no Lightning callback yet):

* ``scores``: the stability benchmark's figures (Wortsman et al.'s LR sensitivity, OLMo 2's spike score, the
  largest LR that trains).
"""
