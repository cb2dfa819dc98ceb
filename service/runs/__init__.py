"""What runs inside a run's Ray Job: the run driver (``driver``) and user-model inspection (``inspect``)."""
