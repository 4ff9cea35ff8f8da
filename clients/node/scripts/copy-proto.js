#!/usr/bin/env node
'use strict';
// npm pack's prepack/postpack: the published package carries the contract it
// loads (proto/kvsvc/v1/*.proto, copied from the repository's proto/, the one
// place it is written), and the checkout goes back to loading ../../proto.
//   node scripts/copy-proto.js          copy into ./proto
//   node scripts/copy-proto.js --clean  remove ./proto
const fs = require('node:fs');
const path = require('node:path');

const here = path.resolve(__dirname, '..');
const dest = path.join(here, 'proto');
fs.rmSync(dest, { recursive: true, force: true });
if (process.argv[2] !== '--clean') {
  const src = path.resolve(here, '..', '..', 'proto', 'kvsvc', 'v1');
  const out = path.join(dest, 'kvsvc', 'v1');
  fs.mkdirSync(out, { recursive: true });
  const protos = fs.readdirSync(src).filter((f) => f.endsWith('.proto'));
  if (protos.length === 0) throw new Error(`no .proto files in ${src}`);
  for (const f of protos) fs.copyFileSync(path.join(src, f), path.join(out, f));
  console.log(`copy-proto: ${protos.length} files from ${src} into ${out}`);
}
