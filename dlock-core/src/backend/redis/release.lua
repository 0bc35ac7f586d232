-- Free one lock, only for its owner (free.lua is prepended).
-- KEYS[1] lock; ARGV[1] owner. Returns 0 when freed, -1 when not held by
-- this owner. Re-entries are counted by the engine: this runs for a
-- process's last hold only.
return free(KEYS[1], ARGV[1])
