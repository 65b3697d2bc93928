"""Command-line options as data.

- :mod:`.spec`: :func:`~.spec.arg`, the declaration of one option (help, group, choices,
  range, supported values, refusal);
- :mod:`.annotations` and :mod:`.checks`: the checks every declared option gets, run in
  one loop over the fields (types, refusals, choices, ranges, supported values);
- :mod:`.model`, :mod:`.runtime`, :mod:`.scheduling`: the engine's options, one mixin per
  concern, combined into :class:`pagedllm.core.engine_args.EngineArgs`, with the defaults,
  ranges and choices of the config fields they feed (:mod:`pagedllm.core.configs`);
- :mod:`.refusals`: every removed or deprecated flag and the shared reasons for refusing
  unsupported ones, in one table;
- :mod:`.validate`: the engine-specific rules run on top of the declared checks (the
  rules about a config's own fields are that config's ``check``).
"""
