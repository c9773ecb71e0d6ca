"""Costs and hardware: what each layer of a model costs (:mod:`.spec`), where
those costs come from (the GTX 1080 Ti profiles in :mod:`.reference`, the
analytic :mod:`.zoo`, both by name in :mod:`.catalog`) and what the server is
(:mod:`.hardware`). Everything downstream (plans, policies, the simulator, the
planner) reads these; nothing here knows about plans or graphs."""
