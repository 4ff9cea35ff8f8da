'use strict';
// Starts a real `kvsvc serve` on 127.0.0.1 (port picked by the server) and stops it.
const { spawn } = require('node:child_process');
const fs = require('node:fs');
const net = require('node:net');
const os = require('node:os');
const path = require('node:path');

const CLIENT_DIR = path.resolve(__dirname, '..', '..');
const STARTUP_TIMEOUT_MS = 60_000;
const live = new Set();

function kvsvcBin() {
  return path.resolve(CLIENT_DIR, process.env.KVSVC_BIN || '../../.venv/bin/kvsvc');
}

/**
 * The real server with no Session RPC (one from before it):
 * clients/testdata/kvsvc_without_session.py, run by the venv's python
 * ($KVSVC_PYTHON, else the python beside the kvsvc executable).
 */
function withoutSessionCommand() {
  const python = process.env.KVSVC_PYTHON || path.join(path.dirname(kvsvcBin()), 'python');
  return [python, path.resolve(CLIENT_DIR, '..', 'testdata', 'kvsvc_without_session.py')];
}

/**
 * @param {{failpoints?: string, args?: string[], withoutSession?: boolean}} [opts]
 * @returns {Promise<{address: string, shmDir: string, log: () => string, kill: () => void, stop: () => Promise<void>}>}
 */
async function startServer(opts = {}) {
  const shmDir = fs.mkdtempSync(path.join(os.tmpdir(), 'kvsvc-node-shm-'));
  const env = { ...process.env, KVSVC_FAILPOINTS: opts.failpoints ?? '' };
  const [bin, ...pre] = opts.withoutSession ? withoutSessionCommand() : [kvsvcBin()];
  const child = spawn(bin, [
    ...pre, 'serve', '--listen', '127.0.0.1:0', '--shm-dir', shmDir, '--shutdown-grace', '1',
    '--device', 'cpu', ...(opts.args ?? []),
  ], { env, stdio: ['ignore', 'ignore', 'pipe'] });
  live.add(child);
  let log = '';
  const exited = new Promise((resolve) => child.once('exit', (code, signal) => resolve({ code, signal })));
  exited.then(() => live.delete(child));
  const address = await new Promise((resolve, reject) => {
    const timer = setTimeout(() => {
      child.kill('SIGKILL');
      reject(new Error(`kvsvc did not start within ${STARTUP_TIMEOUT_MS} ms:\n${log}`));
    }, STARTUP_TIMEOUT_MS);
    child.once('error', (err) => { clearTimeout(timer); reject(err); });
    child.stderr.setEncoding('utf8');
    child.stderr.on('data', (text) => {
      log = (log + text).slice(-200_000);
      const m = /serving on (127\.0\.0\.1:\d+)/.exec(log);
      if (m) { clearTimeout(timer); resolve(m[1]); }
    });
    exited.then(({ code, signal }) => {
      clearTimeout(timer);
      reject(new Error(`kvsvc exited (${code ?? signal}) before serving:\n${log}`));
    });
  });
  return {
    address,
    shmDir,
    log: () => log,
    /** SIGKILL: the server dies mid-call, as in a crash. */
    kill() { child.kill('SIGKILL'); },
    async stop() {
      if (child.exitCode === null && child.signalCode === null) {
        child.kill('SIGTERM');
        const timer = setTimeout(() => child.kill('SIGKILL'), 5000);
        await exited;
        clearTimeout(timer);
      }
      fs.rmSync(shmDir, { recursive: true, force: true });
    },
  };
}

/** A 127.0.0.1 address on which nothing listens (bound, then closed). */
async function refusedAddress() {
  const srv = net.createServer();
  await new Promise((resolve) => srv.listen(0, '127.0.0.1', resolve));
  const { port } = srv.address();
  await new Promise((resolve) => srv.close(resolve));
  return `127.0.0.1:${port}`;
}

// Never leave a server behind, whatever happens to the test process.
function killAll() { for (const child of live) child.kill('SIGKILL'); }
process.on('exit', killAll);
for (const sig of ['SIGINT', 'SIGTERM', 'SIGHUP']) {
  process.once(sig, () => { killAll(); process.exit(128 + os.constants.signals[sig]); });
}

module.exports = { startServer, refusedAddress, kvsvcBin };
