"""The shared base: config, broker, run state, formats and domain rules every upper floor builds on."""
