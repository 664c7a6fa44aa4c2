"""The words the simulated engine writes with: prose, code and reasoning. The tokenizer is
trained on them (tokenizer.py) and the text generator draws from them (text.py)."""

from __future__ import annotations

WORDS = (
    "the history of tea begins in southwest China where leaves were first brewed as a medicinal drink "
    "during the Shang dynasty and later spread along trade routes to Japan Korea India and Europe "
    "merchants carried compressed bricks across mountains while monks cultivated gardens near temples "
    "ceremonies developed around preparation and serving and each region shaped its own customs flavor "
    "and meaning over many centuries of careful practice patient growth and quiet exchange between "
    "cultures cities and families who gathered around warm cups to share stories news and ideas"
).split()
CODE = (
    "def", " process", "_items", "(", "items", ")", ":", "\n", "    ", "total", " =", " 0", "\n", "    ",
    "for", " item", " in", " items", ":", "\n", "        ", "if", " item", " >", " 0", ":", "\n",
    "            ", "total", " +=", " item", "\n", "    ", "return", " total", "\n", "\n",
)
REASONING = (" Okay", ",", " the", " user", " asks", " a", " question", ".", " Let", " me", " think",
              " it", " through", " step", " by", " step", ".")
