"""``hpc-cli bench``: seeded chat traces (:mod:`.trace`, :mod:`.generate`), their replay against
cache modes (:mod:`.replay`), the report and table (:mod:`.report`) and the plots (:mod:`.plots`)."""
