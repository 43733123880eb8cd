'use strict';
// jobsignal-js-peer: a grpc-js client of job.Job for jobsignal's interop tests.
//
// Prints the same JSON lines as tests/interop/go/main.go (state, registered,
// message, end, done, wire; dialed, ping and goaway are read off the wire).
// To see the wire, the client talks to the server through a byte-for-byte
// relay inside this process that counts HTTP/2 frames in both directions.
//
// Usage: node client.js register|subscribe|subscribe-list --target HOST:PORT
//   [--role R] [--count N] [--keepalive-ms MS] [--permit-without-calls]
//   [--hold-ms MS] [--timeout-ms MS] [--gzip]
// With no options the client uses grpc-js's defaults.

const crypto = require('crypto');
const net = require('net');
const path = require('path');
const { parseArgs } = require('util');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const started = process.hrtime.bigint();
const PROTO_ROOT = path.resolve(__dirname, '..', '..', '..', 'protos');

function emit(event, fields = {}) {
  const t = Number(process.hrtime.bigint() - started) / 1e9;
  process.stdout.write(JSON.stringify({ ...fields, event, t }) + '\n');
}

function signalJSON(s) {
  const { HcclJson, ...fields } = s;
  const digest = crypto.createHash('sha256').update(HcclJson, 'utf8').digest('hex');
  return { ...fields, hcclBytes: Buffer.byteLength(HcclJson, 'utf8'), hcclSha256: digest };
}

// -- the relay that counts frames ----------------------------------------------

const FRAME_NAMES = ['DATA', 'HEADERS', 'PRIORITY', 'RST_STREAM', 'SETTINGS', 'PUSH_PROMISE',
  'PING', 'GOAWAY', 'WINDOW_UPDATE', 'CONTINUATION'];

function frameCounter(skip, onFrame) {
  const counts = {};
  let pending = Buffer.alloc(0);
  function feed(chunk) {
    pending = Buffer.concat([pending, chunk]);
    if (skip > 0) {
      const n = Math.min(skip, pending.length);
      skip -= n;
      pending = pending.subarray(n);
    }
    while (pending.length >= 9) {
      const length = pending.readUIntBE(0, 3);
      if (pending.length < 9 + length) break;
      const type = pending[3];
      const name = FRAME_NAMES[type] || `TYPE_${type}`;
      counts[name] = (counts[name] || 0) + 1;
      onFrame(type, pending[4], pending.subarray(9, 9 + length));
      pending = pending.subarray(9 + length);
    }
  }
  return { feed, counts };
}

const relayed = [];
// DATA frames sent whose first byte is a gRPC message's compressed flag set
// (this client's requests are small: one frame each, unpadded).
let compressedData = 0;

function startRelay(host, port) {
  const sockets = new Set();
  const server = net.createServer((downstream) => {
    const upstream = net.connect(port, host);
    sockets.add(downstream);
    sockets.add(upstream);
    const sent = frameCounter(24, (type, flags, payload) => { // after the client preface
      if (type === 6 && (flags & 1) === 0) emit('ping');
      if (type === 0 && payload.length > 0 && payload[0] === 1) compressedData += 1;
    });
    const received = frameCounter(0, (type, flags, payload) => {
      if (type === 7 && payload.length >= 8) {
        emit('goaway', { code: payload.readUInt32BE(4), debug: payload.subarray(8).toString() });
      }
    });
    relayed.push({ sent: sent.counts, received: received.counts });
    upstream.on('connect', () => emit('dialed', { local: `127.0.0.1:${upstream.localPort}` }));
    downstream.on('data', (data) => sent.feed(data));
    upstream.on('data', (data) => received.feed(data));
    downstream.pipe(upstream);
    upstream.pipe(downstream);
    const close = () => { downstream.destroy(); upstream.destroy(); };
    for (const socket of [downstream, upstream]) {
      socket.on('error', close);
      socket.on('close', () => { sockets.delete(socket); close(); });
    }
  });
  return new Promise((resolve) => {
    server.listen(0, '127.0.0.1', () => resolve({
      port: server.address().port,
      close() { server.close(); for (const socket of sockets) socket.destroy(); },
    }));
  });
}

function emitWire() {
  const total = { sent: {}, received: {} };
  for (const connection of relayed) {
    for (const side of ['sent', 'received']) {
      for (const [name, n] of Object.entries(connection[side])) {
        total[side][name] = (total[side][name] || 0) + n;
      }
    }
  }
  emit('wire', { connections: relayed.length, ...total, compressedData });
}

// -- the client --------------------------------------------------------------------

function watchState(channel) {
  let state = channel.getConnectivityState(false);
  emit('state', { state: grpc.connectivityState[state] });
  const next = () => channel.watchConnectivityState(state, Infinity, () => {
    state = channel.getConnectivityState(false);
    emit('state', { state: grpc.connectivityState[state] });
    if (state !== grpc.connectivityState.SHUTDOWN) next();
  });
  next();
}

function emitEnd(rpc, error) {
  const code = error ? error.code : grpc.status.OK;
  emit('end', { rpc, code, codeName: grpc.status[code], message: error ? error.details : '' });
}

async function main() {
  const [command, ...rest] = process.argv.slice(2);
  const { values: o } = parseArgs({
    args: rest,
    options: {
      target: { type: 'string', default: '127.0.0.1:8899' },
      role: { type: 'string', default: 'CCAgent' },
      count: { type: 'string', default: '0' },
      'keepalive-ms': { type: 'string', default: '0' },
      'permit-without-calls': { type: 'boolean', default: false },
      'hold-ms': { type: 'string', default: '0' },
      'timeout-ms': { type: 'string', default: '60000' },
      gzip: { type: 'boolean', default: false },
    },
  });
  if (!['register', 'subscribe', 'subscribe-list'].includes(command)) {
    process.stderr.write('usage: client.js register|subscribe|subscribe-list [options]\n');
    process.exitCode = 2;
    return;
  }
  const definition = protoLoader.loadSync('job/job.proto', {
    includeDirs: [PROTO_ROOT], keepCase: true, defaults: true,
  });
  const { Job } = grpc.loadPackageDefinition(definition).job;
  const [host, port] = [o.target.slice(0, o.target.lastIndexOf(':')),
    Number(o.target.slice(o.target.lastIndexOf(':') + 1))];
  const relay = await startRelay(host, port);
  const options = {};
  if (Number(o['keepalive-ms']) > 0) {
    options['grpc.keepalive_time_ms'] = Number(o['keepalive-ms']);
    options['grpc.keepalive_timeout_ms'] = 20000;
    options['grpc.keepalive_permit_without_calls'] = o['permit-without-calls'] ? 1 : 0;
  }
  if (o.gzip) options['grpc.default_compression_algorithm'] = 2; // gzip: every request message
  const client = new Job(`127.0.0.1:${relay.port}`, grpc.credentials.createInsecure(), options);
  watchState(client.getChannel());
  const deadline = Date.now() + Number(o['timeout-ms']);
  const finish = () => {
    emitWire();
    client.close();
    relay.close();
  };

  const reply = await new Promise((resolve) => {
    client.Register({ role: o.role }, { deadline }, (error, status) => {
      if (error) {
        emitEnd('Register', error);
        resolve(null);
        return;
      }
      emit('registered', { code: status.code, info: status.info, clientId: status.clientId });
      resolve(status);
    });
  });
  if (reply === null || reply.code !== 200) return finish();
  if (command === 'register') {
    await new Promise((resolve) => setTimeout(resolve, Number(o['hold-ms'])));
    if (Number(o['hold-ms']) > 0) {
      const state = client.getChannel().getConnectivityState(false);
      emit('held', { state: grpc.connectivityState[state] });
    }
    return finish();
  }
  const list = command === 'subscribe-list';
  const rpc = list ? 'SubscribeJobSummarySignalList' : 'SubscribeJobSummarySignal';
  const call = client[rpc]({ role: o.role, clientId: reply.clientId }, { deadline });
  const count = Number(o.count);
  let received = 0;
  let done = false;
  await new Promise((resolve) => {
    call.on('data', (message) => {
      received += 1;
      const signals = list ? message.jobSummarySignals.map(signalJSON) : [signalJSON(message)];
      const extra = list ? { ReportTime: message.ReportTime, JobTotalNum: message.JobTotalNum } : {};
      emit('message', { signals, ...extra });
      if (count > 0 && received >= count && !done) {
        done = true;
        emit('done', { received });
        call.cancel();
        resolve();
      }
    });
    // grpc-js may emit 'end' after 'error': the first of them is the status.
    call.on('error', (error) => {
      if (!done) emitEnd(rpc, error);
      done = true;
      resolve();
    });
    call.on('end', () => {
      if (!done) emitEnd(rpc, null);
      done = true;
      resolve();
    });
  });
  finish();
}

main().catch((error) => {
  emit('error', { message: String(error && error.stack) });
  process.exitCode = 1;
});
