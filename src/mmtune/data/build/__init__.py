"""Building MMDU-style multi-image dialogue data from a user's own corpus.

Stages (see docs/data_building.md): :mod:`corpus` reading -> :mod:`embedding` ->
:mod:`clustering` -> image :mod:`sets` -> :mod:`teacher` calls -> :mod:`parsing` and
:mod:`assemble` (validated MMDU records) -> :mod:`pipeline` (resume, shards) ->
:mod:`writer` (merge, images, stats). ``mmtune data build CONFIG`` runs them (:mod:`cli`).
"""
