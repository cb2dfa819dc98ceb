"""The Ray cluster meshrun runs on: the owned or existing head (``head``), Ray Jobs and the per-run channel
actor (``jobs``), and placement of a layout's ranks on nodes (``placement``)."""
