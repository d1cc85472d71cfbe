"""The pipeline engine: how a model is cut (partition), how one stage runs (stage, materialize, recompute), which
micro-batch runs when (schedule, microbatch), the step that plays a schedule over the wire (executor), and what a
step costs on given links (timing). No Lightning imports."""
