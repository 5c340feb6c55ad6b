"""Training methods, one subpackage each (``llmkit/train/<method>/``).

Each method exposes ``llmkit.train.<method>.recipe`` with ``CONFIG_CLASSES``
(a tuple of dataclasses, TRL config subclasses where a TRL trainer is
wrapped) and ``main(*configs)``. ``llmkit train <method>`` parses YAML plus
``--key value`` overrides into those dataclasses with TRL's ``TrlParser``;
``skeleton.py`` is the frame every recipe shares (parsing, resuming from the
last checkpoint, resolved config, plots, results JSON).
"""

# method name -> module exposing CONFIG_CLASSES and main()
METHODS: dict[str, str] = {
    "halo": "llmkit.train.halo.recipe",
    "vspo": "llmkit.train.vspo.recipe",
    "hgms": "llmkit.train.hgms.recipe",
    "lqzo": "llmkit.train.lqzo.recipe",
    "smith": "llmkit.train.smith.recipe",
}
