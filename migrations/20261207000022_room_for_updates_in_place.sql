-- Room on each page for the next version of its rows. A run's row is
-- rewritten on every input (its state is about 1.7 kB for a three-step
-- run), an attempt's once when it finishes. An update stays on its page
-- without a new entry in any index (a HOT update) only where the page has
-- room for the new version; old versions are pruned only once no snapshot
-- can see them, which under load is some milliseconds later. At fillfactor
-- 80 a page of runs held three rows and room for one new version: two
-- updates of runs in three wrote a new entry in each of its seven indexes,
-- and three of four attempt updates in each of its two. Half of each page
-- is kept free now; the rows already stored keep their pages.
ALTER TABLE runs SET (fillfactor = 50);
ALTER TABLE run_attempts SET (fillfactor = 50);
