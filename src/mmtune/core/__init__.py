"""The contract layer: the types that data, models, training and evaluation all build on.

``data/`` turns records into :class:`~mmtune.core.dialogue.Dialogue` objects and encoded
examples into batches; ``models/`` renders a dialogue into an
:class:`~mmtune.core.encoded.EncodedDialogue` and images into model inputs. Both import
these modules and neither imports the other (``tests/test_import_cycles.py``). This
package imports nothing else of mmtune.

- :mod:`mmtune.core.dialogue`: ``Dialogue``, ``Turn``, ``Image`` and how turns are numbered in messages;
- :mod:`mmtune.core.encoded`: ``IGNORE_INDEX``, ``TokenChunk``, ``ImageChunk``, ``EncodedTurn``, ``EncodedDialogue``;
- :mod:`mmtune.core.images`: ``ImageLimits`` and the image errors (``ImageTooLargeError``, ``CorruptImageError``).
"""
