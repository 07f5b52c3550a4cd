"""moplex: mixtures of Plackett-Luce models over LLM responses."""
