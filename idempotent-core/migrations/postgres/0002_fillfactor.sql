-- Leave room on each page so completing a record can be a HOT update (no index writes).
ALTER TABLE {table} SET (fillfactor = 80);
