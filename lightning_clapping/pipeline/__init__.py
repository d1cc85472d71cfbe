"""The pipeline engine: how a model is cut (partition), how one stage runs (stage), which micro-batch runs when
(schedule), and the step that plays a schedule over the wire (executor). No Lightning imports."""
