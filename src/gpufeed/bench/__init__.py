"""`gpufeed bench`: the usual DataLoader against gpufeed, side by side, in one run."""
