"""What an evaluation leaves for people to read: ``report.md`` (:mod:`.report`, with the
plots of :mod:`.plots`), ``viewer.html`` (:mod:`.viewer`) and the paper's tables over many
runs (:mod:`.tables`, ``mmtune report``, with the published numbers in :mod:`.paper_numbers`).
Each benchmark writes its own report section and viewer entries; the report and the viewer
are handed them."""
