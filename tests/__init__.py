"""regen's tests, in folders that follow the code's: base/, producer/, workers/, data/, ops/, cli/; what they share is in support/."""
