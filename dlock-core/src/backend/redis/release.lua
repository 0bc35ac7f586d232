-- Free one lock, only for its owner (free.lua is prepended).
-- KEYS[1] lock; ARGV[1] owner; ARGV[2] 'w' to take back only what the
-- owner's waits left (a withdrawal, see free.lua).
-- Returns 0 when freed (withdrawn), -1 when not held by this owner (nothing
-- to withdraw). Re-entries are counted by the engine: this runs for a
-- process's last hold only.
return free(KEYS[1], ARGV[1], ARGV[2] == 'w')
